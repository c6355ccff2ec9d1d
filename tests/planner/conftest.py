from pathlib import Path

import pytest

# The DAPPLE authors' published profiles (PipeDream graph format), kept beside the checkout.
_CANDIDATES = [
    Path(__file__).resolve().parents[2] / "shared/reference/dapple-profiles",
    Path(__file__).resolve().parents[3] / "shared/reference/dapple-profiles",
]
REFERENCE = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[-1])


@pytest.fixture(autouse=True)
def _reference_profiles(request):
    if "reference" in request.keywords and not REFERENCE.is_dir():
        pytest.skip(f"reference profiles not found at {REFERENCE}")


def pytest_configure(config):
    config.addinivalue_line("markers", "reference: needs the DAPPLE reference profiles")
