"""What runs only on a CUDA device: the verification step's CUDA graphs (`graphs.py`)."""
