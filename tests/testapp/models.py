from django.db import models


class Widget(models.Model):
    """A business model with a non-integer primary key, for aggregate tests."""

    code = models.CharField(max_length=20, primary_key=True)
    name = models.CharField(max_length=50, default="")
