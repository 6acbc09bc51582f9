"""The projections of each module's gradient: random (Rademacher, orthogonal, Kronecker) and the stored
whitened / eigen ones, their widths and fingerprint.
"""
