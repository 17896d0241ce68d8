"""Reading and writing weight files: lazy safetensors, bf16 and MXFP4 formats, checkpoints."""
