"""Devices: what each client can compute, hold and send.

- :class:`DeviceProfile` (validated, frozen) and :func:`parse_profile` / :class:`ProfileError`
  for readable boundary errors;
- the shipped catalog of real devices, :func:`load_catalog` / :func:`get_device`;
- :class:`Fleet`, the profile of every client (tier mix, FedScale-style trace, or fleet file);
- :func:`probe_host`, a profile of the machine radbo runs on;
- budgets (:mod:`radbo.devices.budget`): training memory, capacity r and local steps per device.
"""

from radbo.devices.budget import (
    Budget,
    BudgetPlanner,
    DeviceTooSmallError,
    MemoryEstimate,
    capacity_for,
    estimate_training_memory,
    local_steps_for,
    measure_peak_memory,
)
from radbo.devices.catalog import get_device, load_catalog
from radbo.devices.fleet import Fleet, largest_remainder_counts
from radbo.devices.probe import probe_host
from radbo.devices.profile import DeviceProfile, ProfileError, format_profile_errors, parse_profile

__all__ = [
    "Budget",
    "BudgetPlanner",
    "DeviceProfile",
    "DeviceTooSmallError",
    "MemoryEstimate",
    "capacity_for",
    "estimate_training_memory",
    "local_steps_for",
    "measure_peak_memory",
    "Fleet",
    "ProfileError",
    "format_profile_errors",
    "get_device",
    "largest_remainder_counts",
    "load_catalog",
    "parse_profile",
    "probe_host",
]
