"""Device-family backends and the contract every backend, built-in or third-party, implements."""

from backends.contract import (
    AttributeValue,
    Backend,
    BackendContext,
    BackendError,
    ClaimRef,
    ConfigError,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceName,
    Health,
    HealthEvent,
    Inventory,
    Prepared,
    PrepareError,
    Version,
)

__all__ = [
    "AttributeValue",
    "Backend",
    "BackendContext",
    "BackendError",
    "ClaimRef",
    "ConfigError",
    "CounterConsumption",
    "CounterSet",
    "Device",
    "DeviceName",
    "Health",
    "HealthEvent",
    "Inventory",
    "PrepareError",
    "Prepared",
    "Version",
]
