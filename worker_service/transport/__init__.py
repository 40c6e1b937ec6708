"""The worker's transports: base.py states the two interfaces and which module is which."""
