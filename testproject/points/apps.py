from django.apps import AppConfig


class PointsConfig(AppConfig):
    name = "points"
    default_auto_field = "django.db.models.BigAutoField"
