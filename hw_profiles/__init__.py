"""Hardware profiles: one TOML file per device kind, validated on load.

Imports neither ``edge_client`` nor ``coordinator``.
"""

from hw_profiles.loader import (
    CODEC_BITS,
    FIELDS,
    PYTHON_FLOOR,
    HardwareProfile,
    ProfileError,
    list_profiles,
    load_profile,
    parse_profile,
    profile_dir,
)

__all__ = [
    "CODEC_BITS", "FIELDS", "PYTHON_FLOOR", "HardwareProfile", "ProfileError", "list_profiles",
    "load_profile", "parse_profile", "profile_dir",
]
