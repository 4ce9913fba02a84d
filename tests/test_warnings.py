"""The suite's warning filter: a deprecation raised from django_outbox fails the test."""

from __future__ import annotations

import warnings

import pytest
from django.utils.deprecation import RemovedInNextVersionWarning


@pytest.mark.once
@pytest.mark.parametrize("category", [RemovedInNextVersionWarning, PendingDeprecationWarning])
def test_a_deprecation_raised_from_django_outbox_is_an_error(category):
    with pytest.raises(category):
        warnings.warn_explicit(
            "deprecated", category, "django_outbox/admin.py", 1, module="django_outbox.admin"
        )


@pytest.mark.once
def test_a_deprecation_raised_elsewhere_is_only_reported():
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit(
            "deprecated", DeprecationWarning, "elsewhere.py", 1, module="some_library"
        )
