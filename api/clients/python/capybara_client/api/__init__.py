# flake8: noqa

# import apis into api package
from capybara_client.api.audit_api import AuditApi
from capybara_client.api.connections_api import ConnectionsApi
from capybara_client.api.events_api import EventsApi
from capybara_client.api.health_api import HealthApi
from capybara_client.api.migrations_api import MigrationsApi
from capybara_client.api.policy_api import PolicyApi
from capybara_client.api.servers_api import ServersApi
from capybara_client.api.services_api import ServicesApi
from capybara_client.api.tokens_api import TokensApi

