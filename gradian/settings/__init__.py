"""Gradian's settings: the schemas of the `grads` group (`grads.py`) and of the attribute stage
(`attribute.py`). The bottom room: every other room reads its keys, choices and defaults here."""
