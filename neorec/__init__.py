"""neorec: Neo-style training of large deep learning recommendation models on PyTorch.

Run the default job:  ``neorec train``  (or ``python -m neorec train``).
"""

__version__ = "0.1.0"
