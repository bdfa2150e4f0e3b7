from django.contrib import admin

from endpoints.models import GPUType, ModelSpec, Node


@admin.register(ModelSpec)
class ModelSpecAdmin(admin.ModelAdmin):
    list_display = ["name", "family", "parameters", "layers", "kv_heads", "head_dim",
                    "max_context", "attention_kind", "licence"]
    list_filter = ["family", "attention_kind"]
    search_fields = ["name", "slug", "hf_repo"]


@admin.register(GPUType)
class GPUTypeAdmin(admin.ModelAdmin):
    list_display = ["name", "vendor", "memory_bytes", "bandwidth_gb_s", "hourly_price_usd"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "gpu_type", "cpu_count", "memory_bytes", "last_heartbeat_at"]
    list_filter = ["state"]
    readonly_fields = ["registered_at", "last_heartbeat_at"]
