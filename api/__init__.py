"""The HTTP face of Treadle: FastAPI app, routes, auth, error mapping, admin CLI.

The only package that speaks HTTP. Importing it must not import torch.
"""
