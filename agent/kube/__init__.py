"""The Kubernetes API: the one client, the API's name and quantity formats, and the Events the agent writes."""
