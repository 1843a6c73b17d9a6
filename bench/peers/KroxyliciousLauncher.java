// Starts a Kroxylicious proxy from a config file, for bench/peers.py.  Kroxylicious'
// own launcher (kroxylicious-app) is not on Maven Central; its runtime library is.
import io.kroxylicious.proxy.KafkaProxy;
import io.kroxylicious.proxy.config.ConfigParser;
import io.kroxylicious.proxy.internal.config.Features;
import java.nio.file.Files;
import java.nio.file.Path;

public class KroxyliciousLauncher {
    public static void main(String[] args) throws Exception {
        ConfigParser parser = new ConfigParser();
        var config = parser.parseConfiguration(Files.readString(Path.of(args[0])));
        try (KafkaProxy proxy = new KafkaProxy(parser, config, Features.defaultFeatures())) {
            proxy.startup();
            System.out.println("kroxylicious started");
            proxy.block();
        }
    }
}
