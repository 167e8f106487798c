from .loader import AutoDeployConfig, load_config

__all__ = ["AutoDeployConfig", "load_config"]
