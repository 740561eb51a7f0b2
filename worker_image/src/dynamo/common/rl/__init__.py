"""Reinforcement-learning admin routes: request validation and the route registry."""

from dynamo.common.rl.admin import (
    TRUE_ENV_VALUES,
    RLAdminValidationError,
    RLRouteHandler,
    RLRouteRegistry,
    env_bool,
    first_endpoint_response,
    register_rl_routes,
    require_lora_load_request,
    require_lora_unload_request,
)

__all__ = [
    "TRUE_ENV_VALUES",
    "RLAdminValidationError",
    "RLRouteHandler",
    "RLRouteRegistry",
    "env_bool",
    "first_endpoint_response",
    "register_rl_routes",
    "require_lora_load_request",
    "require_lora_unload_request",
]
