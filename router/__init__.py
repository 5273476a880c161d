"""Orbital's Ray Serve application: router (OpenAI + TGI HTTP, Python handles) and engine replicas.

`build_app(AppConfig(...))` returns the Serve application; see router/README.md.
Imports are lazy so `import router` stays light (no Ray start, no torch import).
"""

from __future__ import annotations

__all__ = ["AppConfig", "build_app"]


def __getattr__(name: str):
    if name == "AppConfig":
        from router.config import AppConfig

        return AppConfig
    if name == "build_app":
        from router.app import build_app

        return build_app
    raise AttributeError(name)
