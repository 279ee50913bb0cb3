"""smsplit: DeepSeek-V3's GPU systems tricks for NVIDIA Hopper, as a Python library."""

__version__ = "0.1.0"
