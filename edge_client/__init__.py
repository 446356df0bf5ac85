"""fedbit edge SDK: integer-only training, uplink codecs, wire protocol, MQTT device loop.

Nothing in this package imports torch at module level, and nothing imports
``coordinator``: a Raspberry Pi installs ``fedbit`` without either.
"""

__version__ = "0.1.0"
