# Makes `k3ref` importable when pytest runs from the repository root (`python3 -m pytest reference/tests`):
# pytest's default import mode puts this file's directory (reference/) on sys.path.
