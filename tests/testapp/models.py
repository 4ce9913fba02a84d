from django.db import models

from django_outbox.consumer.handlers import SourceEventModel


class Widget(models.Model):
    """A business model with a non-integer primary key, for aggregate tests."""

    code = models.CharField(max_length=20, primary_key=True)
    name = models.CharField(max_length=50, default="")


class NeverMigrated(SourceEventModel):
    """A handler's de-duplication model whose table no migration creates: a consumer
    service that has not run ``migrate`` (the consumer tests create and drop it)."""

    class Meta:
        managed = False
        db_table = "testapp_never_migrated"
