"""How a server comes to life and goes away. Every backend ends in the same HTTPS protocol."""
