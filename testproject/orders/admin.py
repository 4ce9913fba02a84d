from django.contrib import admin

from .models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "user_id", "amount", "created_at")
    search_fields = ("number",)
