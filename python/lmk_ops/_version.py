# The release version, read by the build (pyproject.toml); a CUDA wheel's version adds the local label +cu130.
# At run time lmk_ops.__version__ is the built extension's full version.
__version__ = "0.1.0"
