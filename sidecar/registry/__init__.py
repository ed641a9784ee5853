"""Registries behind one protocol (base.py), one module per registry kind, and the transfer."""
