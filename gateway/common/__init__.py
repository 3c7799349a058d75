"""What every part of the gateway shares, at its bottom layer: the ServerConfig and its flags,
APIError, the residency records several wings read (Location, AdapterRecord), and background
clean-up tasks."""
