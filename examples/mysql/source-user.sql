-- The user a Sluice source connects as (capture, the api's creation checks and the initial
-- load). Run it as an administrator on every source server, with your own password; put the
-- same password in the secret the changefeed's source URL names (mysql://sluice:secret:NAME@...).
--
--   REPLICATION SLAVE   read the binlog (capture registers as a replica)
--   REPLICATION CLIENT  binlog position and list (MariaDB >= 10.5 shows it as BINLOG MONITOR)
--   SELECT              table definitions and the initial load's copy
CREATE USER IF NOT EXISTS 'sluice'@'%' IDENTIFIED BY 'change-me';
GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'sluice'@'%';
