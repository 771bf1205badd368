"""blockd's wire protocol, version 1: code generated from ``proto/blockd/v1/``.

Every other file here is written by ``scripts/gen_proto.py``; do not edit them
by hand (CI runs the script with ``--check``).
"""
