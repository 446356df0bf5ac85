"""Hardware profiles: one TOML file per device kind, validated on load.

Imports no ``coordinator`` and, of ``edge_client``, only the codec table (when a profile
is checked: its ``codec`` and ``codec_bits``).
"""

from hw_profiles.loader import (
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
    "FIELDS", "PYTHON_FLOOR", "HardwareProfile", "ProfileError", "list_profiles",
    "load_profile", "parse_profile", "profile_dir",
]
