"""Delivery of subscriptions: webhooks and mail, from every serving process."""
