# Sourced by the MariaDB image's entrypoint on a new data directory (docker-entrypoint-initdb.d):
# the replication user of examples/mysql/source-user.sql, with the password of the compose
# secret source_password, so capture and the api never log in as root. The SQL goes to the
# server on stdin (docker_process_sql), so the password is on no command line; ' and \ in it are
# escaped for the string literal.
sluice_pw=$(sed -e 's/\\/\\\\/g' -e "s/'/''/g" "${SLUICE_SOURCE_PASSWORD_FILE:-/run/secrets/source_password}")
docker_process_sql <<SQL
CREATE USER IF NOT EXISTS 'sluice'@'%' IDENTIFIED BY '${sluice_pw}';
GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'sluice'@'%';
SQL
unset sluice_pw
