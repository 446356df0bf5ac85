"""fedbit edge SDK: integer-only training, uplink codecs, wire protocol, MQTT device loop.

Nothing in this package imports torch at module level, and nothing imports
``coordinator``: a Raspberry Pi installs ``fedbit`` without either. It runs on Python
>= 3.9 (``PYTHON_FLOOR``; the coordinator needs 3.11): no 3.10+ syntax or library here
(``tests/project/test_py39.py``), ``edge_client.compat`` has the two things it would reach for.
"""

__version__ = "0.1.0"

#: the oldest Python the device side runs on (Raspberry Pi OS bullseye, JetPack 5's python3.9);
#: ``requires-python`` in pyproject.toml and ``hw_profiles.PYTHON_FLOOR`` say the same
PYTHON_FLOOR = (3, 9)
