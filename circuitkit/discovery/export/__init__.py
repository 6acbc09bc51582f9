"""Circuits written for other tools: the EAP-IG JSON (`interop`) and MIB's submission (`mib`)."""
