"""The Kubernetes API as the agent sees it: the one client (`client`) and the URL paths it requests (`paths`), the
errors of its requests (`errors`, `unreachable`), and the API's formats with their messages: names and label values
(`names`), quantities (`quantity`), times (`times`). The Events the agent writes live in `agent/events/`."""
