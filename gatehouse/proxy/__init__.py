"""The trio side: listeners, upstream connections, per-connection pumps.

``serve_proxy(config, policy, observers)`` runs a proxy; ``Proxy`` is its state.
"""

from gatehouse.proxy.config import ProxyConfig, config_from_text, load_config
from gatehouse.proxy.hooks import (
    Close,
    ConnectionInfo,
    Forward,
    Observer,
    Pending,
    Policy,
    Respond,
)
from gatehouse.proxy.server import Proxy, serve_proxy

__all__ = [
    "Close",
    "ConnectionInfo",
    "Forward",
    "Observer",
    "Pending",
    "Policy",
    "Proxy",
    "ProxyConfig",
    "Respond",
    "config_from_text",
    "load_config",
    "serve_proxy",
]
