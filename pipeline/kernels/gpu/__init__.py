"""GPU kernels (OpenCL / Metal): what they share."""

# work-groups a decode launch should have to fill the GPU: 4 per shader processor of an Adreno 750 (12 SPs), the
# figure every GPU schedule here sizes its launches for (report/gpu_cost.py, which may not import kernels, states
# the same figure for its cost model)
FILL_GROUPS = 48
