import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.util.List;
import java.util.Map;
import org.apache.kafka.common.metrics.KafkaMetric;
import org.apache.kafka.common.metrics.MetricsReporter;
import org.apache.kafka.server.telemetry.ClientTelemetryExporter;
import org.apache.kafka.server.telemetry.ClientTelemetryExporterProvider;

/**
 * A broker's receiver of the clients' own metrics (KIP-714), as a cluster with a
 * telemetry plugin has one (metric.reporters): each push it gets is one line, "client id,
 * client instance id, metrics bytes, terminating", appended to the file the system
 * property gatehouse.telemetry.file names. For the tests only.
 */
public class TelemetryRecorder implements MetricsReporter, ClientTelemetryExporterProvider {
    private Path out;

    @Override
    public void configure(Map<String, ?> configs) {
        out = Path.of(System.getProperty("gatehouse.telemetry.file"));
    }

    @Override
    public void init(List<KafkaMetric> metrics) {
    }

    @Override
    public void metricChange(KafkaMetric metric) {
    }

    @Override
    public void metricRemoval(KafkaMetric metric) {
    }

    @Override
    public void close() {
    }

    @Override
    public ClientTelemetryExporter clientTelemetryExporter() {
        return (context, payload) -> {
            String line = context.authorizableRequestContext().clientId() + " "
                + payload.clientInstanceId() + " " + payload.data().remaining() + " "
                + payload.isTerminating() + "\n";
            synchronized (this) {
                try {
                    Files.writeString(out, line, StandardCharsets.UTF_8,
                        StandardOpenOption.CREATE, StandardOpenOption.APPEND);
                } catch (IOException exc) {
                    throw new RuntimeException(exc);
                }
            }
        };
    }
}
