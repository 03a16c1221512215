"""Images in: fetching, decoding and preprocessing on a worker pool (image_worker.py), the
model's own processor (processing.py), the encoder cache and the step's image rows."""
