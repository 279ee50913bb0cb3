"""smsplit: DeepSeek-V3's GPU systems tricks for NVIDIA Hopper, as a Python library."""

from smsplit import versions as _versions

__version__ = "0.1.0"

_versions.check()  # torch and Triton within the supported releases (smsplit.versions), before any module uses them
