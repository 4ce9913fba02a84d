from django.contrib import admin
from django.urls import path
from prometheus_client.django import PrometheusDjangoView

urlpatterns = [
    path("admin/", admin.site.urls),
    # prometheus_client's default registry, where django_outbox registers its collector.
    path("metrics", PrometheusDjangoView.as_view(), name="metrics"),
]
