"""Console views (server-rendered, htmx), one module per area of the console. Each view parses,
authorizes through `governance.views.common.console_view`, reads through the tenant-scoped
manager, calls a service for any change and renders."""
