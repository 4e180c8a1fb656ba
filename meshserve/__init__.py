"""meshserve: what every service shares (stubs, config, telemetry, CLI, launcher)."""

__version__ = "0.1.0"
