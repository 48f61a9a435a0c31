"""The simulated node's kernel side: what a real kernel does when sysfs control files are written, in a
process of its own beside the agent."""
