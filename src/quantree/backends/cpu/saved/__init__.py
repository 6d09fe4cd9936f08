"""Saving and loading lowered models: the writer, the untrusted-archive reader, its checks."""
