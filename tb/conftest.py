import warnings

from amaranth.hdl import UnusedElaboratable

# Parameter-validation tests construct components that raise before use; Amaranth would
# report each at interpreter exit.
warnings.filterwarnings("ignore", category=UnusedElaboratable)
