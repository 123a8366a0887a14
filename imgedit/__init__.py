"""imgedit: edit images with the Qwen image-edit models on the GPUs you have."""

__version__ = "0.1.0"
