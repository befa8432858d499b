"""Backends, one package each: its ``__init__`` holds the pure descriptor(s) the policy reads
(``DESCRIPTORS``), its other modules the implementation. See ``arfuse.catalog``."""
