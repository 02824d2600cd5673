"""Small utilities below every other layer: byte sizes, local worker processes, host-memory behaviour."""
