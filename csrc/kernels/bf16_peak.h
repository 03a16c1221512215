// The peak rate of one core's multiply-add units, measured by a tiny loop: 12 independent
// chains held in registers (fma_peak.c's loop), of 512-bit fp32 FMAs or of vdpbf16ps; and of
// AMX's tile products. A kernel's GFLOP/s reads against these (benchmarks/bf16_kernels.py).
#pragma once

namespace deepinfer {

// GFLOP/s of `iters` rounds of 12 instructions over the calling thread's CPU time (a bf16
// pair product counts 4 FLOPs a lane, an FMA 2); 0 when the CPU lacks the instructions.
double dot_peak_gflops(bool bf16, long iters);

// GFLOP/s of `iters` rounds of four TDPBF16PS into four C tiles from two A and two B tiles
// loaded once (the 2 x 2 tiles of bf16_amx.cpp's products, with no loads or stores) over the
// calling thread's CPU time, 16 x 16 x 32 multiply-adds a product; 0 where bf16_amx_available() is false.
double amx_peak_gflops(long iters);

// Seconds of the calling thread's CPU time for `iters` rounds of: four TDPBF16PS (amx_loop's
// round), 12 chains of 8 512-bit FMAs each, and both in one loop, in out[0..2]. Where the
// tiles and the vector units work side by side, both take about the longer of the two alone;
// where they take turns, their sum. All zeros where bf16_amx_available() is false.
void amx_fma_overlap(long iters, double out[3]);

}  // namespace deepinfer
