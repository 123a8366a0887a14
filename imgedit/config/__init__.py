"""Configuration: every setting imgedit reads (the registry) and every parser of a setting's value.

A leaf: imports nothing of imgedit's but `imgedit.errors`. Torch-free, pure.
"""
