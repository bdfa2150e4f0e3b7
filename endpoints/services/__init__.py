"""Writes for catalogs, node liveness and endpoints, one module per sub-domain; importing from
the package itself keeps working. Nodes register and heartbeat through their agent
(fleet.reports)."""

from endpoints.services.adapters import (
    do_add_adapter_from_hub,
    do_add_adapter_from_upload,
    do_remove_adapter,
)
from endpoints.services.catalog import CATALOG_DIR, do_import_model, do_load_catalogs
from endpoints.services.deployment import (
    RESERVED_NAMES,
    context_length_refusal,
    do_create_endpoint,
    do_delete_endpoint,
    do_restart_endpoint,
    do_scale_endpoint,
    do_start_endpoint,
    do_stop_endpoint,
)
from endpoints.services.hub_models import do_add_model_from_hub, do_pin_model, do_promote_models
from endpoints.services.nodes import do_drain_node, do_mark_lost_nodes, do_undrain_node
from endpoints.services.policy import do_change_endpoint_policy
from endpoints.services.quota import hold_quota
from endpoints.services.scaling import (
    do_autoscale_endpoint,
    do_change_endpoint_scaling,
    do_scale_endpoint_to_zero,
    do_wake_endpoint,
    idle_time_refusal,
)

__all__ = [
    "CATALOG_DIR", "RESERVED_NAMES", "context_length_refusal", "do_add_adapter_from_hub",
    "do_add_adapter_from_upload", "do_add_model_from_hub", "do_remove_adapter",
    "do_autoscale_endpoint",
    "do_change_endpoint_policy", "do_change_endpoint_scaling", "do_create_endpoint",
    "do_delete_endpoint", "do_drain_node", "do_import_model", "do_load_catalogs",
    "do_mark_lost_nodes", "do_pin_model", "do_promote_models", "do_restart_endpoint",
    "do_scale_endpoint", "do_scale_endpoint_to_zero", "do_start_endpoint", "do_stop_endpoint",
    "do_undrain_node", "do_wake_endpoint", "hold_quota", "idle_time_refusal",
]
