"""The quantization core: capture, annotate, prepare, calibrate, convert, lower.

It knows nothing of recurrent layers, backends, files or the command line; those wings
(``quantree.recurrent``, ``quantree.backends``, ``quantree.tools``) stand on it.
"""
