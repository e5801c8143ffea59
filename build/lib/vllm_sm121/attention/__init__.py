"""The SM121 attention backend: ``--attention-backend SM121``."""
