"""Device ops: for each kernel family its NumPy twin (the reference that
defines what the op computes) and, on the GPU backend, its CUDA kernel."""
