"""DP ranks behind one router: rank processes, Ray launcher, torchrun entry, offline driver."""
